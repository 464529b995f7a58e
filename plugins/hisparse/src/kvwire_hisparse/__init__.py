"""kvwire-hisparse: the host-pool (HiSparse) index mapper."""
