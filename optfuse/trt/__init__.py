"""TensorRT stage: backend compatibility (TensorRT / TensorRT-RTX), plugins generated from the op
specs (QDP AOT or classic Python IPluginV3), and engine builds that fail loudly when a fused node
does not become a plugin layer.

Nothing here imports TensorRT at module import time; :func:`optfuse.trt.compat.load` does.
"""
