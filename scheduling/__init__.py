"""The decision core: ledger, capacity rule, routing, queue, dispatch order, affinity."""
