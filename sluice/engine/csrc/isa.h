/* The name of an exported kernel in one ISA build: sluice_<name>_<SLUICE_ISA>.
 *
 * setup.py compiles each kernel source once per instruction-set variant it ships (-march
 * levels; -DSLUICE_ISA=avx2 and so on), so one library holds every variant side by side and
 * torch_bindings.cpp picks one at run time from the CPU's flags (dispatch.h). */
#ifndef SLUICE_ISA
#error "build with -DSLUICE_ISA=<variant> (setup.py does)"
#endif
#define SLUICE_CAT_(a, b) a##b
#define SLUICE_CAT(a, b) SLUICE_CAT_(a, b)
#define SLUICE_KERNEL(name) SLUICE_CAT(SLUICE_CAT(sluice_, name), SLUICE_CAT(_, SLUICE_ISA))
