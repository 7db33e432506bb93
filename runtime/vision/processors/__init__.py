"""One module per family of image processors; ``llmc.runtime.vision.processor`` picks one for a checkpoint."""
