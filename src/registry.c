/* registry.c: the table of every kernel, built from kernels/kernels.def. */
#include "internal.h"

const gp_kernel_info gp_kernel_table[] = {
#define GP_KERNEL(family, name, params, spec, doc) {#name, #family, #params, spec, doc},
#include "../kernels/kernels.def"
#undef GP_KERNEL
};

int gp_kernel_count(void) { return GP_NKERNELS; }

const gp_kernel_info *gp_kernel_get(int i) { return i >= 0 && i < GP_NKERNELS ? &gp_kernel_table[i] : 0; }
