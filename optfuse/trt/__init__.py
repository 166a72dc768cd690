"""The TensorRT backend: backend compatibility (TensorRT / TensorRT-RTX, :mod:`.compat`), plugins
generated from the op specs (QDP AOT or classic Python IPluginV3: :mod:`.plugins`, :mod:`.qdp`,
:mod:`.glue`), the parser-side checks (:mod:`.prepare`), engine builds that fail loudly when a
fused node does not become a plugin layer (:mod:`.build`), and engine runs (:mod:`.run`).

The pipeline calls this package; it never imports the pipeline, the CLI, verify or report.
Nothing here imports TensorRT at module import time; :func:`optfuse.trt.compat.load` does.
"""
