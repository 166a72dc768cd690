"""The wiring layer: every end-to-end flow, one function per CLI command. The CLI parses and
prints; the pipeline runs the stages; the stages never import the pipeline or the CLI.

Layers (imports point down only; the import-linter contract in pyproject.toml)::

    cli                  optfuse.cli: typer commands, console output, exit codes
    pipeline             this package: inspect, fuse, verify, demo, build, convert
    report               every report, rendered from the stages' results
    stages               verify | trt (compat, plugins, engine build and run) | precision | estimate
                         | models, over fusions -> rewrite (match, rewrite) -> pattern
    bottom               ir (load, sanitize) | kernels | recipe (schema) | functions, over spec,
                         over defaults | target | model_families | plugin_dirs | errors

Stages and their artifacts (data flows one way)::

    model (file, or exported from a recipe)  --fuse-->    fused .onnx + <model>.fusion_report.{json,md}
    original + candidate                     --verify-->  VerifyResult (per-output errors)
    fused .onnx                              --build-->   TensorRT engine + build report
    model or recipe                          --convert--> fuse -> precision -> verify -> build, one directory

Every flow takes its inputs, the recipe, the command line's :class:`Overrides` and a `status`
(a :class:`Progress`: numbered steps with counts and elapsed time, or a plain callable given
progress text) and returns a typed outcome. The recipe stops here: :mod:`.options` turns it and
the overrides into the typed options each stage takes (FusionOptions, VerifyOptions,
PrecisionOptions, BuildProfile). Modules: :mod:`.options`, :mod:`.model` (where the model comes
from), :mod:`.fuse` (inspect, fuse, verify, demo), :mod:`.build`, :mod:`.convert`, :mod:`.arrays`
(input and output files of verify), :mod:`.starter` (``recipe init``), :mod:`.per_node` (``verify --per-node``,
convert's per-node step), :mod:`.debug` (``debug``).
"""

from .build import BuildOutcome, build
from .convert import ConvertOutcome, RunArrays, Step, convert
from .debug import DebugOutcome, debug
from .fuse import (DEMO_DIR, DEMO_RECIPE, DemoOutcome, FuseOutcome, InspectOutcome, default_output, demo, fuse,
                   inspect, raise_if_failed, verify)
from .model import EXPORT_HINT, export_model, graph_problem, load_checked, resolve_model
from .options import (NO_OVERRIDES, DimPlan, Overrides, Progress, Status, StepRecord, analysis_dims, as_progress,
                      build_profile, enabled_families, fusion_options, options_record, precision_options, read_recipe,
                      resolve_dims, verify_options)
from .per_node import PerNodeOutcome, verify_per_node

__all__ = [
    "NO_OVERRIDES", "DimPlan", "Overrides", "Progress", "RunArrays", "StepRecord", "as_progress", "options_record",
    "resolve_dims", "DEMO_DIR", "DEMO_RECIPE", "EXPORT_HINT", "BuildOutcome", "ConvertOutcome", "DemoOutcome", "FuseOutcome",
    "InspectOutcome", "Status", "Step", "analysis_dims", "build", "build_profile", "convert", "default_output",
    "demo", "enabled_families", "export_model", "fuse", "fusion_options", "graph_problem", "inspect",
    "load_checked", "precision_options", "raise_if_failed", "read_recipe", "resolve_model", "verify",
    "verify_options", "DebugOutcome", "PerNodeOutcome", "debug", "verify_per_node",
]
