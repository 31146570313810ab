"""CPU deployment: ONNX and OpenVINO conversion, INT8, their runners (``runtimes``), and the checked export behind
``aft-vision export``. May import ``layers``, ``models`` and ``checkpoints``."""
from .checked_export import calibration_files, export, write_model
from .runtimes import (FORMATS, PRECISIONS, SUFFIXES, convert_openvino, export_onnx, float_convolutions, load_runner,
                       onnx_runner, openvino_runner, quantize_onnx, quantize_openvino)
