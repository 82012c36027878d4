"""Data plane: layout planning (pure), the transfer-engine fence, executors."""
