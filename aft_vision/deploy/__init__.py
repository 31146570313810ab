"""CPU deployment: ONNX and OpenVINO conversion, the INT8 recipes of onnxruntime and NNCF, their runners, and the
checked export behind ``aft-vision export``. May import ``layers``, ``models`` and ``checkpoints``."""
from .checked_export import calibration_files, export
from .runtimes import (FORMATS, PRECISIONS, convert_openvino, export_onnx, float_convolutions, load_runner, onnx_runner,
                       openvino_runner, quantize_onnx, quantize_openvino, temporary_onnx)
