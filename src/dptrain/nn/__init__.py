"""Drop-in DP versions of torch modules whose weights the engine cannot see directly.

Each is built from covered layers (``nn.Linear``), computes what the torch module
computes, and reads and writes the torch module's state dict. Plain torch: this package imports nothing of
dptrain.
"""
from .attention import DPMultiheadAttention
from .recurrent import DPGRU, DPLSTM, DPRNN

__all__ = ["DPRNN", "DPLSTM", "DPGRU", "DPMultiheadAttention"]
