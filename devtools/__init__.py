"""Development tools, not shipped in the image: a local SageMaker runtime emulator and its event-stream encoder."""
