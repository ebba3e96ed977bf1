"""One table-driven test per routing policy, and the registry's: pure state, no network."""
