import sys

from rlvr_lightning.console import quiet_libraries

if __name__ == "__main__":
    sys.argv[1:] = quiet_libraries(sys.argv[1:])
    if sys.argv[1:2] == ["list"]:  # every preset, algorithm and registered piece
        from rlvr_lightning.catalogue import main as list_everything

        list_everything(sys.argv[2:])
        sys.exit(0)  # before torch, Lightning and vLLM read their settings at import
    from rlvr_lightning.cli import main

    main()
