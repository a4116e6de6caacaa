"""Small shared utilities (no process-group state lives here)."""
