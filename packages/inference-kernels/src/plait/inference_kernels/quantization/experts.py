"""``QuantizedExperts``: transformers 5's fused MoE experts with every expert's weights quantized.

transformers 5 stores a MoE layer's experts as two 3-D parameters of one ``*Experts`` module
(``gate_up_proj [E, 2I, H]``: gate rows then up rows; ``down_proj [E, H, I]``) and calls it as
``experts(hidden_states, top_k_index, top_k_weights)``. :class:`QuantizedExperts` takes that
module's place with the same call: each expert's two weights become a :class:`QuantizedLinear`
(so they run the same CPU paths, Triton kernel and torch reference as the dense Linears), the
tokens are sorted by expert once, and every expert that received tokens runs
``down(act(gate(x)) * up(x))`` on its rows, weighted by the router and summed back per token, the
computation of transformers' eager experts.

The codes live in ``gate_up.<e>.weight_codes`` / ``down.<e>.weight_codes`` (and their scales and
zero points), so the state dict holds the quantized experts and not the 3-D parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.inference_kernels.quantization.modules import QuantizedLinear
from plait.kernels.ops.quant_matmul import QuantScheme, check_weight_shape

_WEIGHTS = ("gate_up_proj", "down_proj")


def experts_unsupported(module: nn.Module) -> str | None:
    """Why ``module`` cannot be quantized as fused experts (None: it can).

    A supported module has 3-D ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` parameters,
    no expert biases and an ``act_fn``.
    """
    gate_up, down = (getattr(module, name, None) for name in _WEIGHTS)
    if not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in (gate_up, down)):
        return "no 3-D gate_up_proj/down_proj parameters"
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H], [E, H, I]"
    if any(getattr(module, f"{name}_bias", None) is not None for name in _WEIGHTS):
        return "experts with biases"
    if not callable(getattr(module, "act_fn", None)):
        return "no act_fn"
    return None


def check_experts(name: str, module: nn.Module, scheme: QuantScheme) -> None:
    """Refuse, naming the module and the fix, experts the scheme cannot hold (before any change).

    Raises:
        ValueError: an unsupported layout (see :func:`experts_unsupported`), a group size that
            does not divide H or I, a dtype other than fp32/bf16/fp16, or inf/NaN weights.
    """
    why = experts_unsupported(module)
    if why is not None:
        raise ValueError(f"{name}: {why}; quantize with QuantizeConfig(experts=False) to keep them unquantized.")
    for weight_name in _WEIGHTS:
        w = getattr(module, weight_name)
        if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name}.{weight_name}: dtype {w.dtype} is not supported; cast to fp32, bf16 or fp16.")
        check_weight_shape(tuple(w.shape[1:]), scheme, name=f"{name}.{weight_name}")
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{name}.{weight_name}: holds inf or NaN; fix the checkpoint before quantizing.")


def _shell(module: nn.Module) -> nn.Module:
    """A copy of ``module`` without its two expert weights (to rebuild it on revert)."""
    shell = type(module).__new__(type(module))
    shell.__dict__.update(module.__dict__)
    shell._parameters = {k: v for k, v in module._parameters.items() if k not in _WEIGHTS}
    shell._buffers = dict(module._buffers)
    shell._modules = dict(module._modules)
    return shell


class QuantizedExperts(nn.Module):
    """A transformers ``*Experts`` module whose experts' weights are stored quantized (inference only).

    Args:
        experts: the module to quantize (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
            ``act_fn``); its weights are read, not kept.
        scheme: the format of every expert weight (int4 groups run along H for gate/up and along
            I for down).
        cpu_kernels, bf16_decode, cpu_kernel: as :class:`QuantizedLinear`.

    Raises:
        ValueError: a layout, dtype or shape the scheme cannot hold (named; see :func:`check_experts`).
    """

    def __init__(self, experts: nn.Module, scheme: QuantScheme, *, cpu_kernels: bool = True,
                 bf16_decode: bool = False, cpu_kernel: str = "torch") -> None:
        check_experts(type(experts).__name__, experts, scheme)
        super().__init__()
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        self.num_experts, self.hidden_dim, self.intermediate_dim = down.shape[0], down.shape[1], down.shape[2]
        self.scheme = scheme
        self.dtype = gate_up.dtype
        self.act_fn = experts.act_fn
        options = dict(cpu_kernels=cpu_kernels, bf16_decode=bf16_decode, cpu_kernel=cpu_kernel)
        self.gate_up = nn.ModuleList(QuantizedLinear.from_weight(w, scheme, **options) for w in gate_up)
        self.down = nn.ModuleList(QuantizedLinear.from_weight(w, scheme, **options) for w in down)
        # Not an attribute nn.Module registers: the shell is for revert, not part of the state.
        self.__dict__["_template"] = _shell(experts)

    @property
    def weight_shapes(self) -> tuple[tuple[int, int], ...]:
        """The ``[N, K]`` shape of every quantized expert weight (gate_up ones, then down ones)."""
        return tuple(m.weight_shape for m in (*self.gate_up, *self.down))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every token's router-weighted sum of its experts' gated MLPs.

        Args:
            hidden_states: ``[T, H]``.
            top_k_index: ``[T, k]`` expert ids (an id equal to the number of experts is skipped,
                as transformers does for tokens routed to no local expert).
            top_k_weights: ``[T, k]`` router weights.

        Returns:
            ``[T, H]`` in hidden_states' dtype.
        """
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()
        weights = top_k_weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts[: self.num_experts]):
            if count:
                pairs = order[start:start + count]
                tokens = pairs // k
                gate, up = self.gate_up[expert](hidden_states[tokens]).chunk(2, dim=-1)
                y = self.down[expert](self.act_fn(gate) * up) * weights[pairs, None]
                out.index_add_(0, tokens, y.to(out.dtype))
            start += count
        return out

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up_proj [E, 2I, H], down_proj [E, H, I])`` the codes stand for, in the original dtype."""
        return (torch.stack([m.dequantized_weight() for m in self.gate_up]),
                torch.stack([m.dequantized_weight() for m in self.down]))

    def to_experts(self) -> nn.Module:
        """The original ``*Experts`` module type holding the dequantized weights."""
        module = _shell(self._template)
        for name, w in zip(_WEIGHTS, self.dequantized_weights(), strict=True):
            module._parameters[name] = nn.Parameter(w)
        return module

    def extra_repr(self) -> str:
        scheme = self.scheme
        group = f", group_size={scheme.group_size}, symmetric={scheme.symmetric}" if scheme.kind == "int4" else ""
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, " \
               f"kind={scheme.kind}{group}"
