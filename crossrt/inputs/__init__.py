"""Stage 1, what a run is given: prompt suites and loaders, pair manifests and their model
files (GGUF metadata read directly), chat-template rendering."""
