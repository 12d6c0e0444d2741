def median(values):
  ordered = sorted(values)
  return ordered[len(ordered) // 2]
