def median(xs):
    """The median of a non-empty list of numbers."""
    ys = sorted(xs)
    return ys[len(ys) // 2]
