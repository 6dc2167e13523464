/*
 * common.h - what every part of the native core shares (no Python here).
 */
#ifndef KVGATE_COMMON_H
#define KVGATE_COMMON_H

/* A static helper of a header-only part: a translation unit may leave some of them unused. */
#if defined(__GNUC__) || defined(__clang__)
#define KV_UNUSED __attribute__((unused))
#else
#define KV_UNUSED
#endif

#endif /* KVGATE_COMMON_H */
