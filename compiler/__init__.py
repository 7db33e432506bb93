"""The compiler: checkpoint in, engine artifact out (frontend → passes → backend → artifact)."""
