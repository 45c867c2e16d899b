"""What a checkpoint is: its identity (run, step), whether it is completely written, and the
safetensors naming fix."""
