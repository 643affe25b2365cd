"""``regroup demo``: the whole loop on one machine (scenarios, local nodes, live view, report)."""
