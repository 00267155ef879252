"""Runs at interpreter start when this folder is on PYTHONPATH (tests/failures/test_mutations.py puts it
there): switches off the mechanism MPIFSDP_MUTANT names, in every process of the run."""

import mutants

mutants.apply_from_environment()
