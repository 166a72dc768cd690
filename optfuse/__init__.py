"""optfuse: operator fusion for exported ONNX models.

Stages (one module each, data flows one way):
load -> sanitize -> match -> rewrite -> precision -> build -> verify -> report.
"""

__version__ = "0.1.0"

DOMAIN = "optfuse"
