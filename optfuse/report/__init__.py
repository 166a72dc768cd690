"""Stage `report`: every report optfuse writes, rendered here and nowhere else (Markdown and JSON).

The stages return plain data (FusionResult, VerifyResult, PrecisionResult, BuildReport); these
modules turn it into files:

- :mod:`.fusion`: ``<model>.fusion_report.json`` / ``.md`` (fuse; :func:`build_report` is the dict),
- :mod:`.precision`: ``precision_report.json`` and the summary's precision section,
- :mod:`.accuracy`: ``accuracy_report.json`` / ``.md`` (convert's onnxruntime and engine checks),
- :mod:`.build`: ``build_report.json`` / ``.md`` (build),
- :mod:`.convert`: ``report.md`` and ``report.json``, the convert summary (:mod:`.facts`: its facts),
- :mod:`.html`: ``report.html``, the same facts as one self-contained page with plots (the
  ``report`` extra: jinja2, matplotlib),
- :mod:`.manifest`: ``manifest.json`` of a run directory (outputs with sha256, the run's parameters),
- :mod:`.common`: sizes, Markdown cells, atomic writes.

The report stage reads the other stages' result types; only the pipeline (and the CLI, for
:func:`format_bytes`) imports it.
"""

from .accuracy import accuracy_dict, accuracy_markdown, verify_line, write_accuracy_report
from .build import build_markdown, write_build_report
from .common import format_bytes
from .convert import summary_markdown, write_summary
from .facts import REPORT_JSON as SUMMARY_JSON
from .facts import convert_facts, verify_facts
from .html import EXTRA_HINT, REPORT_HTML, SECTION_IDS, missing_extra, render_html, write_html
from .fusion import REPORT_JSON, REPORT_MD, build_report, render_markdown, report_stem, write_report
from .manifest import MANIFEST, manifest_outputs, read_manifest, write_manifest
from .precision import precision_markdown, write_precision_report

__all__ = [
    "EXTRA_HINT", "MANIFEST", "REPORT_HTML", "REPORT_JSON", "SECTION_IDS", "SUMMARY_JSON", "convert_facts", "missing_extra",
    "render_html", "verify_facts", "write_html", "REPORT_MD", "accuracy_dict", "accuracy_markdown", "build_markdown", "build_report",
    "format_bytes", "manifest_outputs", "precision_markdown", "read_manifest", "render_markdown", "report_stem", "summary_markdown", "verify_line",
    "write_accuracy_report", "write_build_report", "write_manifest", "write_precision_report", "write_report", "write_summary",
]
