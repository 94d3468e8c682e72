"""`servelm diagnose`: "why did TTFT triple?" — capture windows of metrics, compare two, name the cause."""
