"""ZeRO++: quantized weight gathers (qwZ), quantized gradient reduction (qgZ), hierarchical partition (hpZ).

Each piece is a policy object for the engine's extension points
(:mod:`plait.zero_sharding.extension`); :func:`make_zeropp_policies` builds them from a
:class:`ZeroPPConfig`. The quantize/dequantize kernels live in
:mod:`plait.kernels.ops.quantize` (Triton on CUDA, a torch reference elsewhere).
"""

from plait.zero_sharding.zeropp.config import ZeroPPConfig, make_zeropp_policies
from plait.zero_sharding.zeropp.exact import HierarchicalReducer
from plait.zero_sharding.zeropp.gather import HierarchicalParamGatherer, QuantizedParamGatherer
from plait.zero_sharding.zeropp.reduce import QuantizedGradientReducer
from plait.zero_sharding.zeropp.wire import RowLayout

__all__ = [
    "HierarchicalParamGatherer", "HierarchicalReducer", "QuantizedGradientReducer", "QuantizedParamGatherer",
    "RowLayout", "ZeroPPConfig", "make_zeropp_policies",
]
