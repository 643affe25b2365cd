
if __name__ != "regroup.controller":  # the folder imported by its own name, e.g. from the repository root
    raise ImportError(f"import regroup.controller, not {__name__}: regroup installs under the one import name regroup")
