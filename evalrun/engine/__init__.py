"""The generation engine: model forward (`transformer`), the decode loop with capture (`generate`),
step clocks (`timing`)."""
