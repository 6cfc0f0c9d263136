"""Routing, prediction and admission: the worker registry, route candidates and their predicted
latencies, the policies that rank them, budgets, and the admission queue."""
