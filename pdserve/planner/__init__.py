"""Capacity planning: step-cost profiles (costs), and a simulator that replays a workload against the real
scheduler with those costs (simulator). See docs/planning.md."""
