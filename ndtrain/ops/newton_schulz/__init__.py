"""Newton-Schulz orthogonalisation of matrices (Muon's core): ``newton_schulz`` (PyTorch, the
reference and the only form: a Triton kernel would be its fast twin) and ``ns_flops``."""
from ndtrain.ops.newton_schulz.naive import NS_COEFFS, newton_schulz, ns_flops, ns_scalar_map

__all__ = ["NS_COEFFS", "newton_schulz", "ns_flops", "ns_scalar_map"]
