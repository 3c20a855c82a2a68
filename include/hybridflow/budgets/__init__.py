"""Money budgets per project and month: config, state in the ledger, and what happens at 80 % and 100 %."""
