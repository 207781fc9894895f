"""Same as ``sublayer bench``: python benchmarks/run_bench.py [--quick] [--out DIR] [--threads N] ..."""

from sublayer.bench import main

if __name__ == "__main__":
    main()
