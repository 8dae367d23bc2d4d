"""Feed-forward sublayers: the SiLU-gated MLP, and the sparse mixture of experts built of them (qwen3_moe,
qwen2_moe, mixtral) or of gpt_oss's clamped SwiGLU experts.

An MoE layer runs its experts batched over the step's rows: the router scores every row at once, and each expert
that received rows runs once, on exactly those rows (gathered, one ``gate_up`` and one ``down``, scattered back
weighted). No loop runs per token; the loop over experts skips the ones nobody picked. (One loop over experts
rather than a grouped matmul over stacked ``[experts, ...]`` weights: with int8 each expert is its own packed
weight, one kernel call per weight.)

Routing follows each family's transformers code to the dtype:

- qwen3_moe: softmax over the router logits in fp32, top-k, renormalised over the k only when ``norm_topk_prob``;
  the weights are cast back to the model dtype before they scale the expert outputs.
- qwen2_moe: qwen3_moe's routing, plus a shared expert on every row, its output scaled by
  ``sigmoid(shared_gate(x))`` and added after the routed experts'.
- mixtral: softmax in fp32, top-k, always renormalised; the weights stay fp32 while they scale the expert outputs
  (in bf16 the product is fp32 and rounds once, on the way into the sum).
- gpt_oss: router logits with a bias, top-k of the logits, softmax over the k chosen in the logits' dtype.
  Its experts (``ClampedSwiGLU``) have biases on both projections.

All sum the expert outputs in increasing expert order, as transformers does.

Why the router is a batched matmul of single rows (``_row_exact_logits``) rather than ``F.linear``: a dense GEMM's
result for a row changes with the number of rows beside it (measured on this CPU: rows computed alone differ from
the same rows in a batch of 300 in the last bits, 1e-6 to 1e-4), and a router logit a bit off can swap an
expert near the top-k boundary, which changes the row's output entirely. One ``[1, hidden] x [hidden, experts]``
product per row gives a row the same logits whether it is decoded alone or beside a prefill, as the int8 Linear
layers (``linear.Int8DynamicLinear``) do for every other projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from handler.engine.model.family_config import MOE_TENSORS, SHARED_EXPERT_TENSORS, num_experts
from handler.engine.model.kernels import fused_silu_mul
from handler.engine.model.linear import DenseLinear, Int8DynamicLinear

# the gate's activation by its transformers name (``ACT2FN``): gelu_pytorch_tanh is the gemma families'
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


@dataclass(slots=True)
class GatedMLP:
    """``down(activation(gate) * up)``, gate and up fused into one projection (gate rows first); SiLU unless the
    family's MLP says otherwise (``ACTIVATIONS``)."""

    gate_up: DenseLinear | Int8DynamicLinear
    down: DenseLinear | Int8DynamicLinear
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(self.gated(self.gate_up(h)))

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None,
              norm: tuple[torch.Tensor, float, int] | None = None) -> torch.Tensor | None:
        """``residual + self(rms_norm(x))`` in one int8 kernel call where both projections are int8 on the kernel
        and the activation is SiLU (``Int8DynamicLinear.fused_mlp``: the same bits as the ops one by one); None
        elsewhere (the caller runs the ops)."""
        gate_up, down = self.gate_up, self.down
        if self.activation is not F.silu or not type(gate_up) is type(down) is Int8DynamicLinear:
            return None
        return gate_up.fused_mlp(down, x, residual, norm)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``activation(gate) * up`` of gate_up's output (what down reads): SiLU's in one kernel call where it gives
        torch's bits here (``kernels.fused_silu_mul``; fp32 rows on CPU)."""
        if (self.activation is F.silu and gate_up.dtype is torch.float32 and gate_up.device.type == "cpu"
                and gate_up.dim() == 2 and gate_up.is_contiguous()):
            fused = fused_silu_mul()
            if fused is not None:
                return fused(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.activation(gate) * up


@dataclass(slots=True)
class ClampedSwiGLU:
    """gpt_oss's expert: ``down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g))`` with
    ``g = min(gate, limit)``. gate_up is fused gate rows first like ``GatedMLP``'s (the checkpoint interleaves gate
    and up columns: split at load, ``load_moe``). The clamp and the ``+ 1`` make it not linear in up, so int8 cannot
    smooth down through up (``quantize``)."""

    gate_up: DenseLinear | Int8DynamicLinear
    down: DenseLinear | Int8DynamicLinear
    alpha: float
    limit: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down((up.clamp(-self.limit, self.limit) + 1) * glu)


@dataclass(slots=True)
class SparseMoE:
    """A router over ``experts``, each row sent to its ``top_k`` best (see the module docstring for the families'
    routing). ``router`` is ``[num_experts, hidden]`` in the model dtype, kept dense when the experts go int8: its
    logits decide which experts run, and a quantised router would change that decision, not just round a value."""

    router: torch.Tensor
    experts: list[GatedMLP] | list[ClampedSwiGLU]
    top_k: int
    renormalize: bool
    fp32_weights: bool
    shared: GatedMLP | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden], with ``shared``
    router_bias: torch.Tensor | None = None  # [num_experts] (gpt_oss)
    softmax_top_k: bool = False  # gpt_oss: the softmax over the k chosen logits only

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = _row_exact_logits(h, self.router)  # [rows, experts]
        if self.router_bias is not None:
            logits = logits + self.router_bias
        if self.softmax_top_k:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            return self._run_experts(h, chosen.flatten(), torch.softmax(top, dim=-1).flatten())
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [rows, top_k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(logits.dtype)
        out = self._run_experts(h, chosen.flatten(), weights.flatten())
        if self.shared is not None:
            out = out + _row_exact_sigmoid(_row_exact_logits(h, self.shared_gate)) * self.shared(h)
        return out

    def _run_experts(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``chosen``, ``weights``: ``[rows * top_k]``, row-major. Each picked expert runs once on its rows."""
        order = torch.argsort(chosen, stable=True)  # the (row, k) picks grouped by expert, rows ascending
        counts = torch.bincount(chosen, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(h)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if not count:
                continue
            picks = order[start: start + count]
            start += count
            rows = picks // self.top_k
            y = expert(h[rows]) * weights[picks, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


def _row_exact_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid`` of ``[rows, 1]``, the same bits for a row whatever the batch. torch runs an elementwise op with
    vector code over whole vectors and scalar code over the tail, and the two differ in the last bit (measured: 72
    of 2000 rows computed alone differed from the same rows in one batch), so the values are padded to a multiple
    of 64 (every x86 vector loop's step divides it) and all of them take the vector path."""
    rows = x.shape[0]
    return torch.sigmoid(F.pad(x.reshape(-1), (0, -rows % 64)))[:rows].view(rows, 1)


def _row_exact_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T`` as one matrix product per row (``[rows, 1, hidden] x [rows, hidden, experts]``, the weight
    broadcast, not copied), so a row's logits do not depend on the rows beside it."""
    rows = h.shape[0]
    return torch.bmm(h.unsqueeze(1), weight.t().expand(rows, -1, -1)).squeeze(1)


def load_moe(state: dict[str, torch.Tensor], prefix: str, config: dict,
             make: Callable[[torch.Tensor, torch.Tensor | None], DenseLinear | Int8DynamicLinear],
             router_to: Callable[[torch.Tensor], torch.Tensor]) -> SparseMoE:
    """One layer's router and experts from the checkpoint (``prefix``: ``model.layers.{i}.``; the names per family
    in ``family_config.MOE_TENSORS``); ``config`` has its family's defaults filled in."""
    family = config["model_type"]
    if family == "gpt_oss":
        return _load_gpt_oss(state, prefix, config, make, router_to)
    router, names = MOE_TENSORS[family]
    experts = [_gated(state, prefix, [name.format(e=e) for name in names], make) for e in range(num_experts(config))]
    moe = SparseMoE(router=router_to(state[prefix + router]), experts=experts, top_k=config["num_experts_per_tok"],
                    renormalize=family == "mixtral" or bool(config["norm_topk_prob"]),
                    fp32_weights=family == "mixtral")
    if shared := SHARED_EXPERT_TENSORS.get(family):
        moe.shared = _gated(state, prefix, shared[:3], make)
        moe.shared_gate = router_to(state[prefix + shared[3]])
    return moe


def _gated(state: dict[str, torch.Tensor], prefix: str, names: list[str] | tuple[str, ...],
           make: Callable[[torch.Tensor, torch.Tensor | None], DenseLinear | Int8DynamicLinear]) -> GatedMLP:
    """A gated MLP from its gate, up and down weights' names."""
    gate, up, down = (state[prefix + name] for name in names)
    return GatedMLP(make(torch.cat([gate, up]), None), make(down, None))


def _load_gpt_oss(state: dict[str, torch.Tensor], prefix: str, config: dict,
                  make: Callable[[torch.Tensor, torch.Tensor | None], DenseLinear | Int8DynamicLinear],
                  router_to: Callable[[torch.Tensor], torch.Tensor]) -> SparseMoE:
    """gpt_oss stores its experts stacked and transposed (``gate_up_proj`` ``[experts, hidden, 2 * inter]``, gate
    and up in alternate columns; ``down_proj`` ``[experts, inter, hidden]``), each with a bias: cut into one
    ``ClampedSwiGLU`` per expert, gate rows first."""
    router, names = MOE_TENSORS["gpt_oss"]
    router_bias, gate_up, gate_up_bias, down, down_bias = (state[prefix + name] for name in names)
    experts = []
    for e in range(num_experts(config)):
        weight, bias = gate_up[e].t(), gate_up_bias[e]
        gate_first = make(torch.cat([weight[0::2], weight[1::2]]), torch.cat([bias[0::2], bias[1::2]]))
        experts.append(ClampedSwiGLU(gate_first, make(down[e].t().contiguous(), down_bias[e]),
                                     alpha=config["swiglu_alpha"], limit=config["swiglu_limit"]))
    return SparseMoE(router=router_to(state[prefix + router]), experts=experts, top_k=config["num_experts_per_tok"],
                     renormalize=False, fp32_weights=False, router_bias=router_to(router_bias), softmax_top_k=True)
