"""Stage `report`: every report optfuse writes, rendered here and nowhere else (Markdown and JSON).

The stages return plain data (FusionResult, VerifyResult, PrecisionResult, BuildReport); these
modules turn it into files:

- :mod:`.fusion`: ``<model>.fusion_report.json`` / ``.md`` (fuse; :func:`build_report` is the dict),
- :mod:`.precision`: ``precision_report.json`` and the summary's precision section,
- :mod:`.accuracy`: ``accuracy_report.json`` / ``.md`` (convert's onnxruntime and engine checks),
- :mod:`.build`: ``build_report.json`` / ``.md`` (build),
- :mod:`.convert`: ``report.md``, the convert summary,
- :mod:`.manifest`: ``manifest.json`` of a run directory (outputs with sha256, the run's parameters),
- :mod:`.common`: sizes, Markdown cells, atomic writes.

The report stage reads the other stages' result types; only the pipeline (and the CLI, for
:func:`format_bytes`) imports it.
"""

from .accuracy import accuracy_dict, accuracy_markdown, verify_line, write_accuracy_report
from .build import build_markdown, write_build_report
from .common import format_bytes
from .convert import summary_markdown, write_summary
from .fusion import REPORT_JSON, REPORT_MD, build_report, render_markdown, report_stem, write_report
from .manifest import MANIFEST, manifest_outputs, read_manifest, write_manifest
from .precision import precision_markdown, write_precision_report

__all__ = [
    "MANIFEST", "REPORT_JSON", "REPORT_MD", "accuracy_dict", "accuracy_markdown", "build_markdown", "build_report",
    "format_bytes", "manifest_outputs", "precision_markdown", "read_manifest", "render_markdown", "report_stem", "summary_markdown", "verify_line",
    "write_accuracy_report", "write_build_report", "write_manifest", "write_precision_report", "write_report", "write_summary",
]
