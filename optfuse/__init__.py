"""optfuse: operator fusion for exported ONNX models.

Stages (data flows one way; docs/ARCHITECTURE.md says which module owns each):
load -> sanitize -> match -> rewrite -> estimate -> precision -> verify -> build -> verify (engine) -> report.
:mod:`optfuse.pipeline` wires them into flows and :mod:`optfuse.cli` is the command line.
"""

__version__ = "0.1.0"

DOMAIN = "optfuse"
