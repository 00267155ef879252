"""What every other package stands on: argument checks, the array module (NumPy or CuPy), the memory
and communication ledgers, and the threads a rank computes on.

Imports nothing of mpifsdp outside itself (tests/project/test_layering.py). The ledgers live here, below
everything, because nearly every layer records into them; what reads them (observe/) sits on top.
"""
