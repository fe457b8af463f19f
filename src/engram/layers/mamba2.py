"""Mamba2 mixer over a flat batch, reading and writing each sequence's state in the StatePool."""

from __future__ import annotations

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers import parallel
from engram.layers.linear import Linear
from engram.layers.parallel import Shard, even
from engram.models.spec import GateNorm, MambaSpec
from engram.ops.dispatch import kernels


class Mamba2Mixer(nn.Module):
    """`spec.gate_norm` says how the scan output meets the gate; Mamba2's own (norm after the gate)
    has a fused decode op, the others take the state update and the gate as two ops."""

    def __init__(self, spec: MambaSpec, hidden_size: int, layer_index: int):
        super().__init__()
        self.tp = parallel.current()
        self.full_spec = spec
        spec = parallel.local_mamba(spec, self.tp.size) if self.tp is not None else spec
        self.spec = spec
        self.layer_index = layer_index
        d_in = spec.intermediate_size
        self.in_proj = Linear(hidden_size, d_in + spec.conv_dim + spec.num_heads, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(spec.num_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_heads))
        self.D = nn.Parameter(torch.ones(spec.num_heads))
        self.norm = nn.Module()
        if spec.gate_norm != GateNorm.NONE:
            self.norm.weight = nn.Parameter(torch.ones(d_in))
        self.out_proj = Linear(d_in, hidden_size, bias=spec.out_bias)

    def _ranges(self, rank: int) -> dict[str, tuple[tuple[int, int], ...]]:
        """Rank `rank`'s heads, and its channels of x, B and C within the conv's [x, B, C] and of
        z within the gate, in the full mixer's layout."""
        assert self.tp is not None
        s, size = self.full_spec, self.tp.size
        d_in, gn = s.intermediate_size, s.n_groups * s.state_size
        xbc = (even(d_in, rank, size), even(gn, rank, size, d_in), even(gn, rank, size, d_in + gn))
        return {"x": xbc[:1], "xbc": xbc, "heads": (even(s.num_heads, rank, size),)}

    def tp_shards(self) -> dict[str, Shard]:
        """This rank's part of each checkpoint tensor: in_proj's rows are [z, x, B, C, dt]."""
        assert self.tp is not None
        s, r = self.full_spec, self._ranges(self.tp.rank)
        d_in = s.intermediate_size
        rows = (r["x"][0], *((a + d_in, b + d_in) for a, b in r["xbc"]), *((a + d_in + s.conv_dim, b + d_in + s.conv_dim) for a, b in r["heads"]))
        channels, heads = Shard(-1, r["xbc"]), Shard(-1, r["heads"])
        return {
            **parallel.linear_shards(self.tp.rank, rows, column=("in_proj",)),
            "conv1d.weight": Shard(-3, r["xbc"]),
            "conv1d.bias": channels,
            "dt_bias": heads,
            "A_log": heads,
            "D": heads,
            "norm.weight": Shard(-1, r["x"]),
            **parallel.linear_shards(self.tp.rank, r["x"], row=("out_proj",), out_features=self.out_proj.out_features),
        }

    def state_shards(self, rank: int) -> dict[str, Shard]:
        """Rank `rank`'s part of this layer's conv state [K-1, x|B|C] and SSM state [heads, ...]."""
        r = self._ranges(rank)
        return {f"layers.{self.layer_index}.conv": Shard(-1, r["xbc"]), f"layers.{self.layer_index}.ssm": Shard(-3, r["heads"])}

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s, k = self.spec, kernels()
        heads, head_dim, groups, n = s.num_heads, s.head_dim, s.n_groups, s.state_size
        conv_pool = batch.state_pool.of(self.layer_index, "conv")
        ssm_pool = batch.state_pool.of(self.layer_index, "ssm")
        slots = batch.state_slots
        weight = self.conv1d.weight[:, 0, :]

        # The conv and SSD ops read the sequences' states from the pools by slot and write them back
        # in place. At decode the conv update comes with the input projection.
        if batch.is_decode:
            zxbcdt = k.linear_conv_update(
                hidden, self.in_proj.weight, self.in_proj.bias, weight, self.conv1d.bias, conv_pool, slots, s.intermediate_size
            )
            gate, xbc, dt = zxbcdt.split([s.intermediate_size, s.conv_dim, heads], dim=-1)
        else:
            gate, xbc, dt = self.in_proj(hidden).split([s.intermediate_size, s.conv_dim, heads], dim=-1)
            if batch.verify is not None:  # a speculative step: every position's state kept, the pool left as it is
                v = batch.verify
                xbc = k.causal_conv1d_verify(xbc, weight, self.conv1d.bias, conv_pool, slots, v.rows, v.flat, v.windows[self.layer_index, "conv"])
            else:
                xbc = k.causal_conv1d_varlen(xbc, weight, self.conv1d.bias, conv_pool, slots, batch.seq_lens, batch.cu_seqlens)

        x, B, C = xbc.split([s.intermediate_size, groups * n, groups * n], dim=-1)
        x = x.reshape(-1, heads, head_dim)
        B, C = B.reshape(-1, groups, n), C.reshape(-1, groups, n)
        if batch.is_decode and s.gate_norm == GateNorm.AFTER_GATE:
            out = k.ssd_state_update_norm_linear(
                ssm_pool,
                slots,
                x,
                dt,
                self.dt_bias,
                s.time_step_limit,
                self.A_log,
                B,
                C,
                self.D,
                gate,
                self.norm.weight,
                s.norm_eps,
                s.intermediate_size // groups,
                self.out_proj.weight,
                self.out_proj.bias,
            )
            return out if self.tp is None else self.tp.all_reduce(out)
        if batch.is_decode:
            y = k.ssd_state_update(ssm_pool, slots, x, dt, self.dt_bias, s.time_step_limit, self.A_log, B, C, self.D)
        elif batch.verify is not None:
            v = batch.verify
            y = k.ssd_verify(
                x, dt, self.dt_bias, s.time_step_limit, self.A_log, B, C, self.D, v.rows, v.flat, ssm_pool, slots, v.states[self.layer_index, "ssm"]
            )
        else:
            y = k.ssd_varlen(
                x,
                dt,
                self.dt_bias,
                s.time_step_limit,
                self.A_log,
                B,
                C,
                self.D,
                s.chunk_size,
                batch.seq_lens,
                ssm_pool,
                slots,
                batch.cu_seqlens,
            )
        out = self.out_proj(self._gate(y.reshape(-1, s.intermediate_size), gate, hidden.dtype))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _gate(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        s, k = self.spec, kernels()
        if s.gate_norm == GateNorm.NONE:
            return k.silu_gate(y, gate, dtype)
        norm = k.gated_rms_norm if s.gate_norm == GateNorm.AFTER_GATE else k.norm_then_gate
        return norm(y, gate, self.norm.weight, s.norm_eps, s.intermediate_size // s.n_groups, dtype)
