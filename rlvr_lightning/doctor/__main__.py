import sys

from rlvr_lightning.console import quiet_libraries

if __name__ == "__main__":
    argv = quiet_libraries(sys.argv[1:])  # before torch, Lightning and vLLM read their settings at import
    from rlvr_lightning.doctor import main

    main(argv)
