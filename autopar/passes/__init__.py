"""Graph rewrites from a Plan (annotate, collectives, localize, sharding): see ARCHITECTURE.md."""
