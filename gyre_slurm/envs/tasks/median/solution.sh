cat > stats.py <<'PY'
def median(xs):
    """The median of a non-empty list of numbers."""
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2
PY
