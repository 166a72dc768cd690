"""Stage `verify`: run the original and the candidate model on the same inputs, compare every output.

Both models run in onnxruntime (CPU) through polygraphy (``OnnxrtRunner(SessionFromOnnx(...))``),
one session at a time and from their files (weights read by onnxruntime, never loaded here), on a
list of feed dicts built here, so the inputs mean what the model expects:

- from the recipe when it describes an input (``range``, ``kind``, ``npz``);
- else inferred from the graph: an integer input used (through Cast/Reshape/...) as the indices of a
  ``Gather`` on a constant table gets values in ``[0, rows)`` (token ids below the vocabulary size,
  token type ids below the type-table size); an input named like ``*mask*`` gets right-padded 0/1
  masks (ones then zeros; at least one row is padded); other floats are N(0, 1).

Symbolic dims take the recipe's opt values, else batch (the first axis) 2 and 16 for the others
(:mod:`optfuse.defaults`). Every output of the original is compared elementwise: it passes when
``|cand - ref| <= atol + rtol * |ref|`` everywhere (numpy's isclose) over all iterations, with the
tolerances of the candidate's precision (default atol 1e-4, rtol 1e-3 for fp32).

The stage never sees a Recipe: it takes :class:`VerifyOptions` (input specs, opt dims, tolerances
per precision mode), which the pipeline builds from the recipe. :func:`tolerance` is the one rule
for an output's (atol, rtol).

Two entry points: :func:`verify` runs both models in onnxruntime; :func:`verify_against` runs the
original in onnxruntime and hands the same feeds to a *candidate runner* (a callable: feeds in,
outputs out). The TensorRT engine check is the second: the pipeline passes
:func:`optfuse.trt.run.run_engine` as the runner, so the verify stage never imports the TensorRT
backend and the backend never imports verify.

Modules: :mod:`.options` (VerifyOptions, tolerances, the result types), :mod:`.inputs` (input
planning and feeds), :mod:`.compare` (running and comparing), :mod:`.padding` (the padded query
positions a fused attention is not exact at, which the comparisons leave out), :mod:`.per_node` (every
shared tensor compared, per-node error growth and its attribution).
"""

from .compare import CandidateRunner, Feeds, compare_arrays, head_outputs, precision_of, verify, verify_against
from .inputs import DEFAULT_INT_HIGH, InputPlan, gather_table_rows, make_feed, plan_inputs, right_padded_mask
from .options import (DEFAULT_ITERATIONS, Agreement, CheckError, FeedSpec, InputInfo, NotExecuted, OutputResult, Tolerances,
                      VerifyOptions, VerifyResult, default_tolerances, tolerance)
from .padding import padded_query_inputs

__all__ = [
    "DEFAULT_INT_HIGH", "DEFAULT_ITERATIONS", "Agreement", "CandidateRunner", "CheckError", "FeedSpec", "Feeds", "InputInfo",
    "InputPlan", "NotExecuted", "OutputResult", "Tolerances", "VerifyOptions", "VerifyResult", "compare_arrays",
    "default_tolerances", "head_outputs", "gather_table_rows", "make_feed", "padded_query_inputs", "plan_inputs", "precision_of",
    "right_padded_mask",
    "tolerance", "verify", "verify_against",
]
