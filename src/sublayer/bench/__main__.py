from .kernels import main

main()
