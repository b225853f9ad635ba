"""kvlib past one machine: tensor-parallel caches, prefill-to-decode transfer, a disk tier, and the arithmetic at cluster scale."""
