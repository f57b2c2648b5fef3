"""DP versions of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` built from ``nn.Linear`` layers.

Lee & Kifer (sections 5.3-5.4): a recurrent layer's weight gradients are sums over time
steps of outer products of the pre-activation gradient with the step's input (``V``,
input-to-hidden) or the previous hidden state (``W``, hidden-to-hidden). Written with one
``nn.Linear`` for each, a layer is a Linear called on the whole input sequence (``ih``:
one call with T tokens) and a Linear called once per time step (``hh``). The engine
concatenates the calls of one module along the token axis, so per-sample norms include
every cross term between time steps and are exact in every clipping mode; no recurrent
layer rule is needed, and cuDNN's fused kernels (which hide the pre-activations) are not
used.

The modules compute exactly what the torch modules compute (same gate order and
formulas), take the same constructor arguments and forward inputs (batch-first or not,
bidirectional, stacked layers with dropout, ``PackedSequence``, unbatched input), and
read and write the torch modules' state dicts (``weight_ih_l0``, ``bias_hh_l1_reverse``,
``weight_hr_l0``, ...). Their ``named_parameters()`` use the Linear children's names
(``ih_l0.weight``); torch's names still work as attributes (``lstm.weight_hh_l0``).
"""
from __future__ import annotations

import math
import numbers
import re
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

__all__ = ["DPRNN", "DPLSTM", "DPGRU"]


# ---------------------------------------------------------------------------- state-dict names
def _save_under_torch_names(module, state_dict, prefix, local_metadata):
    # This post-hook runs right after our children saved, so our keys are the last ones:
    # popping and re-inserting them in torch's order keeps the global key order intact.
    for key, value in module._torch_state(prefix, state_dict).items():
        state_dict[key] = value


def _load_from_torch_names(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    module._from_torch_state(prefix, state_dict)


def install_torch_name_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` / ``load_state_dict`` use the torch module's key names.

    ``module`` implements ``_torch_state(prefix, state_dict)``, returning ``{torch key: tensor}``
    in torch's order after popping its own keys, and ``_from_torch_state(prefix, state_dict)``,
    renaming torch keys to its own in place (keys already in its own naming are left alone).
    """
    # register_state_dict_post_hook is public from torch 2.5; older versions have the private one.
    register = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
    register(_save_under_torch_names)
    module._register_load_state_dict_pre_hook(_load_from_torch_names, with_module=True)


_TORCH_PARAM = re.compile(r"^(weight|bias)_((?:ih|hh|hr)_l\d+(?:_reverse)?)$")


# ---------------------------------------------------------------------------- the modules
class _DPRecurrentBase(nn.Module):
    """Shared construction, state-dict mapping and the time loop; subclasses define one step."""

    #: gate blocks stacked in the weights (torch's order): RNN 1, LSTM 4 (i, f, g, o), GRU 3 (r, z, n)
    gates: int = 1
    #: whether the recurrent state is (h, c) rather than h
    has_cell_state: bool = False

    def __init__(self, mode, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None):
        super().__init__()
        _check_arguments(input_size, hidden_size, num_layers, bias, batch_first, dropout, proj_size)
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        factory = {"device": device, "dtype": dtype}
        out_size = proj_size or hidden_size
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else out_size * self.num_directions
            for suffix in self._suffixes():
                gate_size = self.gates * hidden_size
                self.add_module(f"ih_l{layer}{suffix}", nn.Linear(layer_input, gate_size, bias, **factory))
                self.add_module(f"hh_l{layer}{suffix}", nn.Linear(out_size, gate_size, bias, **factory))
                if proj_size:
                    self.add_module(f"hr_l{layer}{suffix}", nn.Linear(hidden_size, proj_size, False, **factory))
        self.reset_parameters()
        install_torch_name_hooks(self)

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _suffixes(self) -> tuple[str, ...]:
        return ("", "_reverse") if self.bidirectional else ("",)

    def reset_parameters(self) -> None:
        """torch's initialisation: every weight and bias uniform in +-1/sqrt(hidden_size)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def flatten_parameters(self) -> None:
        """Nothing to flatten (no cuDNN weight buffer); kept so code written for torch's RNNs runs unchanged."""

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            s += f", nonlinearity={self.nonlinearity!r}"
        for name, default in (("bias", True), ("batch_first", False), ("dropout", 0.0), ("bidirectional", False)):
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)}"
        return s

    # ------------------------------------------------------------------ torch names
    def _torch_names(self) -> list[tuple[str, str]]:
        """(torch name, own name) of every parameter, in torch's state-dict order."""
        pairs = []
        for layer in range(self.num_layers):
            for suffix in self._suffixes():
                kinds = [("weight", "ih"), ("weight", "hh")]
                if self.bias:
                    kinds += [("bias", "ih"), ("bias", "hh")]
                if self.proj_size:
                    kinds.append(("weight", "hr"))
                pairs += [(f"{p}_{k}_l{layer}{suffix}", f"{k}_l{layer}{suffix}.{p}") for p, k in kinds]
        return pairs

    def _torch_state(self, prefix, state_dict):
        return {prefix + t: state_dict.pop(prefix + own)
                for t, own in self._torch_names() if prefix + own in state_dict}

    def _from_torch_state(self, prefix, state_dict):
        for t, own in self._torch_names():
            if prefix + t in state_dict:
                state_dict[prefix + own] = state_dict.pop(prefix + t)

    def __getattr__(self, name):
        # torch's parameter names as attributes (e.g. for nn.init.orthogonal_(lstm.weight_hh_l0))
        try:
            return super().__getattr__(name)
        except AttributeError:
            match = _TORCH_PARAM.match(name)
            child = self.__dict__.get("_modules", {}).get(match.group(2)) if match else None
            if child is not None and getattr(child, match.group(1)) is not None:
                return getattr(child, match.group(1))
            raise

    # ------------------------------------------------------------------ forward
    def forward(self, input, hx=None):
        packed = isinstance(input, PackedSequence)
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)  # the caller's batch order
            lengths = lengths.to(x.device)
            batched = True
        else:
            if not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
                shape = tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
                batched_shape = "(N, L, H_in)" if self.batch_first else "(L, N, H_in)"
                raise ValueError(f"{type(self).__name__}: expected input of shape (L, H_in) unbatched or "
                                 f"{batched_shape} batched, or a PackedSequence; got {shape}")
            batched = input.dim() == 3
            x = input.unsqueeze(0) if not batched else input if self.batch_first else input.transpose(0, 1)
            lengths = None
        if x.shape[-1] != self.input_size:
            raise ValueError(f"{type(self).__name__}: input.size(-1) must be equal to input_size. "
                             f"Expected {self.input_size}, got {x.shape[-1]}")
        state = self._initial_state(hx, x, batched)
        output, final = self._run_layers(x, state, lengths)
        if packed:
            output = _repack_like(input, output, lengths)
        elif not batched:
            output = output.squeeze(0)
            final = tuple(s.squeeze(1) for s in final)
        elif not self.batch_first:
            output = output.transpose(0, 1)
        return output, (final if self.has_cell_state else final[0])

    def _initial_state(self, hx, x, batched) -> tuple[torch.Tensor, ...]:
        """[layers * directions, B, size] states; zeros when ``hx`` is None, as torch does."""
        B = x.shape[0]
        sizes = [self.proj_size or self.hidden_size] + ([self.hidden_size] if self.has_cell_state else [])
        depth = self.num_layers * self.num_directions
        if hx is None:
            return tuple(x.new_zeros(depth, B, size) for size in sizes)
        if self.has_cell_state and not (isinstance(hx, tuple) and len(hx) == 2):
            raise ValueError(f"{type(self).__name__}: hx must be a tuple (h_0, c_0)")
        if not self.has_cell_state and not isinstance(hx, torch.Tensor):
            raise ValueError(f"{type(self).__name__}: hx must be a tensor h_0, got {type(hx).__name__}")
        states = hx if self.has_cell_state else (hx,)
        out = []
        for name, s, size in zip(("h_0", "c_0"), states, sizes):
            if s.dim() != (3 if batched else 2):
                raise ValueError(f"{type(self).__name__}: for {'batched 3-D' if batched else 'unbatched 2-D'} input, "
                                 f"{name} should be {3 if batched else 2}-D but got {s.dim()}-D")
            s = s if batched else s.unsqueeze(1)
            if tuple(s.shape) != (depth, B, size):
                raise ValueError(f"{type(self).__name__}: expected {name} of size {(depth, B, size)}, "
                                 f"got {tuple(s.shape)}")
            out.append(s)
        return tuple(out)

    def _run_layers(self, x, state, lengths):
        """Batch-first stacked layers; returns ([B, T, D * out], final states [L * D, B, size])."""
        T = x.shape[1]
        mask = None
        reverse_index = None
        if lengths is not None:
            steps = torch.arange(T, device=x.device)
            mask = steps[None, :] < lengths[:, None]  # [B, T]: steps inside each sequence
            # reverse each sequence within its own length; padding stays where it is
            reverse_index = torch.where(mask, lengths[:, None] - 1 - steps[None, :], steps[None, :])
        finals = [[] for _ in state]
        layer_input = x
        for layer in range(self.num_layers):
            outputs = []
            for direction, suffix in enumerate(self._suffixes()):
                k = layer * self.num_directions + direction
                ih, hh = self._modules[f"ih_l{layer}{suffix}"], self._modules[f"hh_l{layer}{suffix}"]
                hr = self._modules.get(f"hr_l{layer}{suffix}")
                gates_x = ih(layer_input)  # one call for all T steps: the engine sees T tokens
                if direction == 1:
                    gates_x = _reverse_time(gates_x, reverse_index)
                out, last = self._run_direction(gates_x, tuple(s[k] for s in state), hh, hr, mask)
                if direction == 1:
                    out = _reverse_time(out, reverse_index)
                outputs.append(out)
                for f, s in zip(finals, last):
                    f.append(s)
            layer_input = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
            if self.dropout and self.training and layer < self.num_layers - 1:
                # drawn time-major like torch's kernels, so a seeded run drops the same units as nn.LSTM
                layer_input = F.dropout(layer_input.transpose(0, 1).contiguous(), self.dropout, True).transpose(0, 1)
        return layer_input, tuple(torch.stack(f) for f in finals)

    def _run_direction(self, gates_x, state, hh, hr, mask):
        outputs = []
        for t in range(gates_x.shape[1]):
            new_state = self._step(gates_x[:, t], state, hh, hr)
            if mask is not None:
                # a finished sequence keeps its state: later steps get no gradient from it
                keep = mask[:, t, None]
                new_state = tuple(torch.where(keep, n, s) for n, s in zip(new_state, state))
            state = new_state
            outputs.append(state[0])
        return torch.stack(outputs, dim=1), state

    def _step(self, gates_x, state, hh, hr):
        """One time step from the input pre-activations ``gates_x`` [B, gates * H] and the state."""
        raise NotImplementedError


class DPRNN(_DPRecurrentBase):
    """``nn.RNN`` with exact per-sample clipping: ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``."""

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity {nonlinearity!r}. Select from 'tanh' or 'relu'.")
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size, hidden_size, num_layers,
                         bias, batch_first, dropout, bidirectional, 0, device, dtype)
        self.nonlinearity = nonlinearity

    def _step(self, gates_x, state, hh, hr):
        z = gates_x + hh(state[0])
        return (torch.tanh(z) if self.nonlinearity == "tanh" else torch.relu(z),)


class DPLSTM(_DPRecurrentBase):
    """``nn.LSTM`` with exact per-sample clipping (gate order i, f, g, o; optional projection ``proj_size``)."""

    gates = 4
    has_cell_state = True

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, device, dtype)

    def _step(self, gates_x, state, hh, hr):
        h, c = state
        i, f, g, o = (gates_x + hh(h)).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (hr(h) if hr is not None else h, c)


class DPGRU(_DPRecurrentBase):
    """``nn.GRU`` with exact per-sample clipping (gate order r, z, n; ``b_hn`` inside the reset gate, as torch)."""

    gates = 3

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, device=None, dtype=None):
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, 0,
                         device, dtype)

    def _step(self, gates_x, state, hh, hr):
        h = state[0]
        x_r, x_z, x_n = gates_x.chunk(3, dim=1)
        h_r, h_z, h_n = hh(h).chunk(3, dim=1)
        r = torch.sigmoid(x_r + h_r)
        z = torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return ((1 - z) * n + z * h,)


# ---------------------------------------------------------------------------- helpers
def _check_arguments(input_size, hidden_size, num_layers, bias, batch_first, dropout, proj_size):
    """The argument checks of torch's RNNBase, with the same messages."""
    if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
        raise ValueError("dropout should be a number in range [0, 1] representing the probability of an element "
                         "being zeroed")
    if dropout > 0 and num_layers == 1:
        warnings.warn("dropout option adds dropout after all but last recurrent layer, so non-zero dropout expects "
                      f"num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}", stacklevel=3)
    for name, value, kind in (("bias", bias, bool), ("batch_first", batch_first, bool),
                              ("input_size", input_size, int), ("hidden_size", hidden_size, int),
                              ("num_layers", num_layers, int), ("proj_size", proj_size, int)):
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{name} should be of type {kind.__name__}, got: {type(value).__name__}")
    for name, value in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
        if value <= 0:
            raise ValueError(f"{name} must be greater than zero")
    if proj_size < 0:
        raise ValueError("proj_size should be a positive integer or zero to disable projections")
    if proj_size >= hidden_size:
        raise ValueError("proj_size has to be smaller than hidden_size")


def _reverse_time(x: torch.Tensor, reverse_index: torch.Tensor | None) -> torch.Tensor:
    """Reverse [B, T, f] in time, each sequence within its length (an involution)."""
    if reverse_index is None:
        return x.flip(1)
    return x.gather(1, reverse_index[:, :, None].expand_as(x))


def _repack_like(packed: PackedSequence, padded: torch.Tensor, lengths: torch.Tensor) -> PackedSequence:
    """Pack [B, T, f] (the caller's batch order) with ``packed``'s batch sizes and sort order."""
    order = packed.sorted_indices
    in_sorted_order = padded if order is None else padded.index_select(0, order)
    sorted_lengths = lengths if order is None else lengths.index_select(0, order)
    data = pack_padded_sequence(in_sorted_order, sorted_lengths.cpu(), batch_first=True, enforce_sorted=True).data
    return PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
