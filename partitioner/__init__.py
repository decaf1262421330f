"""Strategies, plans (pieces, messages, reductions), memory/FLOP accounting, cost model, search."""
