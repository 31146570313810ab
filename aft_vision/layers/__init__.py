"""AFT operators: the functional core (``functional``) and the token-mixer modules built on it. The ground floor:
may import torch and timm, and nothing else of aft_vision."""
from .aft_conv import AFTConv2d, resize_window_bias, scaled_kernel_size, window_for_size
from .aft_full import AFTFull, AFTLocal, AFTSimple
from .channels_first import layer_norm_nchw, linear_nchw
from ._shared import (capturing, device_policy, exporting, get_conv_method, get_device_policy, plain_autograd,
                      set_conv_method)
from .functional import aft_conv2d, aft_full, aft_local, aft_simple, choose_conv_method
from .tuning import tuned_choices
from .aft_conv_onehot import AFTConv2dOneHot, aft_conv2d_onehot, convert_to_onehot
