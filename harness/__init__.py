"""parbench harness: cli -> matrix -> launch -> worker -> measure -> record -> report."""
