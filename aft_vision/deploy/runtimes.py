"""CPU deployment: a timm model as an ONNX file (timm's ``onnx_export``, token rows) or an OpenVINO model (AFT-conv
channel-first, ``export_layout``), float32 or INT8 (AFT's window convolutions kept float; timm has neither path), and a
runner for either. docs/deployment.md gives the reasons and the measurements."""
import os
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch
from timm.utils.onnx import onnx_export

from ..models import export_layout

__all__ = ['FORMATS', 'SUFFIXES', 'PRECISIONS', 'export_onnx', 'convert_openvino', 'quantize_onnx', 'quantize_openvino',
           'float_convolutions', 'load_runner', 'onnx_runner', 'openvino_runner']

SUFFIXES = {'onnx': '.onnx', 'openvino': '.xml'}  # format -> the file it is written as (OpenVINO: and its .bin)
FORMATS = tuple(SUFFIXES)
# what a runner computes in: OpenVINO's inference precision hint, or INT8 (a quantized model, float parts in float32)
PRECISIONS = ('fp32', 'bf16', 'int8')
OPSET = 18


def export_onnx(model: torch.nn.Module, example: torch.Tensor, path: os.PathLike, dynamic_size: bool = True) -> None:
    """``model`` as an ONNX file (timm's ``onnx_export``, opset 18), ``x`` -> ``logits``, a dynamic batch (and size)."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # the tracer's warnings on the input checks' shape comparisons
        onnx_export(model, str(path), example, opset=OPSET, dynamic_size=dynamic_size, input_names=['x'],
                    output_names=['logits'])


def convert_openvino(model: torch.nn.Module, example: torch.Tensor, dynamic_size: bool = True):
    """``openvino.convert_model`` with AFT-conv recorded channel-first: an ``openvino.Model`` (a dynamic batch; height
    and width: ``dynamic_size``, else ``example``'s)."""
    import openvino as ov

    model.eval()
    shape = {} if dynamic_size else {'input': [ov.PartialShape([-1, *example.shape[1:]])]}
    with warnings.catch_warnings(), torch.no_grad(), export_layout(model, 'NCHW'):
        warnings.simplefilter('ignore')
        return ov.convert_model(model, example_input=example, **shape)


def _graph(path: os.PathLike):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph


def float_convolutions(path: os.PathLike, graph=None) -> List[str]:
    """The grouped convolutions of an ONNX file or ``graph`` (AFT's window convolutions, kept in float)."""
    return [node.name for node in (graph or _graph(path)).node if node.op_type == 'Conv'
            and any(attr.name == 'group' and attr.i > 1 for attr in node.attribute)]


def quantize_onnx(src: os.PathLike, dst: os.PathLike, batches: Sequence[np.ndarray]) -> None:
    """INT8 ONNX ``dst`` from ``src`` by onnxruntime's ``quantize_static`` (QDQ, per channel), calibrated on
    ``batches`` (N, 3, H, W): MatMul, Gemm and Conv, less the grouped convolutions."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    graph = _graph(src)
    weights = {tensor.name for tensor in graph.initializer}
    name = next(value.name for value in graph.input if value.name not in weights)  # the image input
    items = iter([{name: np.ascontiguousarray(batch, dtype=np.float32)} for batch in batches])

    class Reader(CalibrationDataReader):
        def get_next(self):
            return next(items, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=['MatMul', 'Gemm', 'Conv'], nodes_to_exclude=float_convolutions(src, graph))


def quantize_openvino(ov_model, batches: Sequence[np.ndarray]):
    """INT8 ``openvino.Model`` by ``nncf.quantize`` (transformer preset less SmoothQuant, grouped convolutions in
    float), calibrated on ``batches`` (N, 3, H, W)."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    dataset = nncf.Dataset([np.ascontiguousarray(batch, dtype=np.float32) for batch in batches])
    # SmoothQuant (on in the transformer preset) moved the digits model's 48 px top-1 by 1.1 points; without it 0
    no_smooth_quant = AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1))
    return nncf.quantize(ov_model, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(batches),
                         ignored_scope=nncf.IgnoredScope(types=['GroupConvolution'], validate=False),
                         advanced_parameters=no_smooth_quant)


Runner = Callable[[np.ndarray], np.ndarray]


def onnx_runner(path: os.PathLike, threads: Optional[int] = None) -> Runner:
    """Images (N, 3, H, W) -> logits by onnxruntime's CPU provider (``threads``: torch's by default)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=['CPUExecutionProvider'])
    name = session.get_inputs()[0].name
    return lambda images: session.run(None, {name: np.ascontiguousarray(images, dtype=np.float32)})[0]


def openvino_runner(ov_model, precision: str = 'fp32', threads: Optional[int] = None) -> Runner:
    """Images (N, 3, H, W) -> logits by OpenVINO's CPU plugin; 'fp32' / 'bf16': its hint, 'int8': float parts fp32."""
    import openvino as ov

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    config = {'INFERENCE_PRECISION_HINT': 'bf16' if precision == 'bf16' else 'f32',
              'INFERENCE_NUM_THREADS': threads or torch.get_num_threads()}
    compiled = ov.Core().compile_model(ov_model, 'CPU', config)
    request, shape = compiled.create_infer_request(), compiled.inputs[0].get_partial_shape()

    def run(images: np.ndarray) -> np.ndarray:
        if not shape.compatible(ov.PartialShape(list(images.shape))):  # OpenVINO would answer for the last input
            raise ValueError(f'the model takes images of shape {shape} (? any), got {list(images.shape)}')
        return request.infer({0: np.ascontiguousarray(images, dtype=np.float32)})[0].copy()
    return run


def load_runner(path: os.PathLike, precision: str = 'fp32', threads: Optional[int] = None) -> Runner:
    """The runner of an ``.onnx`` file or an ``.xml`` OpenVINO IR."""
    suffix = Path(path).suffix.lower()
    if suffix == SUFFIXES['onnx']:
        return onnx_runner(path, threads)
    if suffix == SUFFIXES['openvino']:
        import openvino as ov

        return openvino_runner(ov.Core().read_model(str(path)), precision, threads)
    raise ValueError(f'{path}: not an ONNX file (.onnx) or an OpenVINO IR (.xml)')
