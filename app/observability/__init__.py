"""Cross-cutting observability: logs now; metrics and traces join here."""
