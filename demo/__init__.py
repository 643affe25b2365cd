"""``regroup demo``: the whole loop on one machine (scenarios, local nodes, live view, report)."""

if __name__ != "regroup.demo":  # the folder imported by its own name, e.g. from the repository root
    raise ImportError(f"import regroup.demo, not {__name__}: regroup installs under the one import name regroup")
