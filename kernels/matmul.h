/* matmul.h: the epilogue codes shared by matmul.c (CPU) and matmul.cu. */
#ifndef GP_MATMUL_H
#define GP_MATMUL_H

/* none; gelu_tanh; gelu_tanh with its input written to aux; the product times
 * gelu_tanh'(aux) */
enum { GP_MM_NONE, GP_MM_GELU, GP_MM_GELU_AUX, GP_MM_DGELU };

#endif
