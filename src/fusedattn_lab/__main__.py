from fusedattn_lab.cli import main

raise SystemExit(main())
