"""Money budgets per project and month: config, state in the ledger, and what happens at 80 % and 100 %.

Kept import-free so DAG files can name the asset without loading the package at parse time.
"""

# Emitted by the nightly allocation DAG for each day it (re)allocates, with extra {"day": "YYYY-MM-DD"};
# the budget evaluation is scheduled on it.
ALLOCATIONS_ASSET = "hybridflow://ledger/allocations"
